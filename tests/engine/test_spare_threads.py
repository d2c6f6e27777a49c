"""Spare threads (engine/csrc/spare_threads.h): helpers that take output columns of a few-row GEMM,
or tasks of the paged attention, while a core is idle. Whoever computes a chunk, its bits are
the same; a helper that stalls after taking a chunk is overtaken by the caller, which never
waits on it; the engine's tokens do not change with them on."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from test_int8_kv import int8_case as int8_kv_case
from test_kernels import random_case

from engine import kernels
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_runner import SPARE_MAX_REQUESTS
from engine.quantization import quantize_rows
from engine.sampling_params import SamplingParams
from tests.conftest import DemoCkptFactory

pytestmark = pytest.mark.skipif(
    kernels.load("spare_threads") is None or kernels.load("int8_linear") is None,
    reason="no C++ toolchain: the native kernels cannot build",
)

SHAPES = [(64, 64), (70, 130), (576, 1000), (2048, 768)]  # (k, n): ragged k and n too
# Up to here a test waits for a helper to compute a chunk (up to 256 rows are shared, the kernels'
# kSpareRows; a longer call gives a helper at SCHED_IDLE on a busy machine too few chances).
HELPED_ROWS = 64


@pytest.fixture
def spare() -> Iterator[Callable[..., None]]:
    """Set the process's spare threads for a test, on one intra-op thread (as a served engine
    computes; with more, OpenMP splits the call); none again after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield kernels.set_spare_threads
    kernels.set_spare_threads(0)
    kernels.set_spare_sharing(True)
    torch.set_num_threads(threads)


def int8_case(m: int, k: int, n: int, seed: int) -> Callable[[str], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    q_w, s_w = quantize_rows(torch.randn(n, k, generator=g) / k**0.5)
    packed, sums = kernels.pack_int8(q_w)
    bias = torch.randn(n, generator=g)
    return lambda path: kernels.int8_linear(x, packed, sums, s_w, n, bias, path)


def invariant_case(m: int, k: int, n: int, layout: str, seed: int) -> Callable[[], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    packed = kernels.pack_linear((torch.randn(n, k, generator=g) / k**0.5).bfloat16(), layout)
    bias = torch.randn(n, generator=g)
    return lambda: kernels.invariant_linear(x, packed, n, bias, layout)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def until(changed: Callable[[], bool], call: Callable[[], object], seconds: float = 60.0) -> bool:
    """Call ``call`` until ``changed()`` (a helper got a core at some point) or time runs out."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        call()
        if changed():
            return True
    return False


def helped_with_the_same_bits(run: Callable[[], torch.Tensor], alone: torch.Tensor) -> None:
    """``run()`` gives ``alone``'s bits, call after call, until a helper has computed a chunk."""
    helped = kernels.spare_stats()[1]

    def same() -> None:
        assert same_bits(run(), alone)

    assert until(lambda: kernels.spare_stats()[1] > helped, same)


@pytest.mark.parametrize("path", kernels.INT8_PATHS)
@pytest.mark.parametrize("m", [1, 5, 64, 256, 257])  # 257: past the shared rows, the plain path
def test_int8_gives_the_same_bits_with_helpers(
    spare: Callable[..., None], path: str, m: int
) -> None:
    if path not in kernels.int8_paths():
        pytest.skip(f"this CPU does not run the {path} path")
    for seed, (k, n) in enumerate(SHAPES):
        run = int8_case(m, k, n, seed)
        spare(0)
        alone = run(path)
        for helpers in (1, 2):
            spare(helpers)
            if m > HELPED_ROWS:
                assert same_bits(run(path), alone)
            else:
                helped_with_the_same_bits(functools.partial(run, path), alone)


@pytest.mark.parametrize("m", [1, 6, 64, 256, 257])
def test_the_invariant_gemm_gives_the_same_bits_with_helpers(
    spare: Callable[..., None], m: int
) -> None:
    for layout in kernels.invariant_layouts():
        for seed, (k, n) in enumerate(SHAPES):
            run = invariant_case(m, k, n, layout, seed)
            spare(0)
            alone = run()
            spare(2)
            if m > HELPED_ROWS:
                assert same_bits(run(), alone)
            else:
                helped_with_the_same_bits(run, alone)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(
    "lens",
    [[700], [1, 17, 130, 513] * 16],  # one decode: its tasks are kv heads; a prompt's 64 queries
)
def test_the_paged_attention_gives_the_same_bits_with_helpers(
    spare: Callable[..., None], cache: str, lens: list[int]
) -> None:
    g = torch.Generator().manual_seed(len(lens))
    if cache == "int8":
        q, k_cache, v_cache, tables = int8_kv_case(g, lens, 3, 3, 64, torch.bfloat16)
    else:
        q, k_cache, v_cache, tables = random_case(g, lens, 3, 3, 64, getattr(torch, cache))
    starts, ends = torch.tensor([n // 3 for n in lens]), torch.tensor(lens)

    def run() -> torch.Tensor:
        return kernels.paged_decode_attention(q, k_cache, v_cache, tables, starts, ends, 0.125)

    def same() -> None:
        assert same_bits(run(), alone)

    spare(0)
    alone = run()
    spare(2)
    helped_with_the_same_bits(run, alone)
    # A helper that stalls after taking each task: the caller takes them back, the same bits.
    spare(1, delay_us=20_000)
    _, _, taken_back = kernels.spare_stats()
    assert until(lambda: kernels.spare_stats()[2] > taken_back, same)


def test_helpers_take_chunks_when_a_core_is_idle(spare: Callable[..., None]) -> None:
    spare(1)
    run = int8_case(1, 2048, 8192, seed=1)
    alone = run("auto")
    helpers, helped, _ = kernels.spare_stats()
    assert helpers == 1
    assert until(lambda: kernels.spare_stats()[1] > helped, lambda: run("auto"))
    assert same_bits(run("auto"), alone)


def test_a_stalled_helpers_chunks_are_taken_back_by_the_caller(spare: Callable[..., None]) -> None:
    """A helper that sleeps 50 ms after taking each chunk (as if it lost its core): the caller
    computes those chunks itself after kStallNs, so a call takes far less than the stall."""
    run_int8 = int8_case(2, 576, 4096, seed=3)
    run_bf16 = invariant_case(2, 576, 4096, kernels.invariant_layouts()[-1], seed=4)
    spare(0)
    want_int8, want_bf16 = run_int8("auto"), run_bf16()
    spare(1, delay_us=50_000)
    _, _, taken_back = kernels.spare_stats()

    def timed() -> float:
        start = time.perf_counter()
        assert same_bits(run_int8("auto"), want_int8)
        assert same_bits(run_bf16(), want_bf16)
        return time.perf_counter() - start

    assert until(lambda: kernels.spare_stats()[2] > taken_back, timed)
    assert min(timed() for _ in range(5)) < 0.045  # never waited out a 50 ms stall


def test_with_several_intra_op_threads_openmp_splits_the_call(spare: Callable[..., None]) -> None:
    """Helpers serve an engine on one thread; beside OpenMP's team (whose threads spin on the
    cores) they would starve, so the call goes to OpenMP as without them -- the same bits."""
    run = int8_case(1, 2048, 8192, seed=2)
    bf16 = invariant_case(1, 2048, 8192, kernels.invariant_layouts()[-1], seed=2)
    spare(0)
    alone, alone_bf16 = run("auto"), bf16()
    spare(1)
    torch.set_num_threads(2)
    helped = kernels.spare_stats()[1]
    for _ in range(50):
        assert same_bits(run("auto"), alone)
        assert same_bits(bf16(), alone_bf16)
    assert kernels.spare_stats()[1] == helped


def test_with_sharing_switched_off_the_gemms_compute_alone(spare: Callable[..., None]) -> None:
    """The engine's switch (a busy engine): off, no helper computes a chunk; on again, they do."""
    run = int8_case(1, 2048, 8192, seed=5)
    bf16 = invariant_case(1, 2048, 8192, kernels.invariant_layouts()[-1], seed=5)
    alone, alone_bf16 = run("auto"), bf16()
    spare(1)
    kernels.set_spare_sharing(False)
    helped = kernels.spare_stats()[1]
    for _ in range(50):
        assert same_bits(run("auto"), alone)
        assert same_bits(bf16(), alone_bf16)
    assert kernels.spare_stats()[1] == helped
    kernels.set_spare_sharing(True)
    helped_with_the_same_bits(lambda: run("auto"), alone)


def test_an_engine_shares_only_while_it_holds_few_requests(
    spare: Callable[..., None], demo_ckpt_factory: DemoCkptFactory
) -> None:
    """Past SPARE_MAX_REQUESTS live requests (waiting ones count) the engine's steps compute
    alone: a full engine means a busy machine, where a helper takes another worker's core."""
    engine = LLMEngine.from_checkpoint(
        demo_ckpt_factory("tiny", "llama", dtype="bfloat16"),
        EngineConfig(dtype="bfloat16", quantization="int8", spare_threads=1, kv_cache_bytes=2**23),
    )
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)
    ids = [engine.add_request(engine.make_request([5, 9, 11 + i], params)) for i in range(9)]
    assert len(ids) == SPARE_MAX_REQUESTS + 1
    helped = kernels.spare_stats()[1]
    for _ in range(30):
        engine.step()
    assert kernels.spare_stats()[1] == helped
    engine.abort(ids[0])
    assert until(lambda: kernels.spare_stats()[1] > helped, engine.step)


def test_resizing_and_bad_counts(spare: Callable[..., None]) -> None:
    spare(3)
    assert kernels.spare_stats()[0] == 3
    spare(1)
    assert kernels.spare_stats()[0] == 1
    spare(0)
    assert kernels.spare_stats()[0] == 0
    with pytest.raises(ValueError, match="spare threads"):
        kernels.set_spare_threads(-1)
    with pytest.raises(ValueError, match="spare threads"):
        kernels.set_spare_threads(1, delay_us=-5)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_an_engines_tokens_do_not_change_with_spare_threads(
    spare: Callable[..., None], demo_ckpt_factory: DemoCkptFactory, quantization: str
) -> None:
    """Greedy and seeded requests, one at a time and together: the same tokens and logprobs."""
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True, logprobs=2),
    ]
    prompts = [[5, 9, 11, 200, 7], [3, 3, 3, 17, 21, 99, 4]]
    tiny = demo_ckpt_factory("tiny", "llama", dtype="bfloat16")

    def outputs(spare_threads: int) -> list[tuple[list[int], list[object]]]:
        config = EngineConfig(
            dtype="bfloat16",
            quantization=quantization,
            spare_threads=spare_threads,
            kv_cache_bytes=2**23,
        )
        engine = LLMEngine.from_checkpoint(tiny, config)
        assert kernels.spare_stats()[0] == spare_threads
        result = []
        for batch in ([0], [1], [0, 1]):
            for i in batch:
                engine.add_request(engine.make_request(prompts[i], params[i]))
            while engine.has_unfinished():
                engine.step()
            for out in sorted(engine.finished_outputs(), key=lambda o: o.request_id):
                result.append((out.token_ids, out.logprobs))
        return result

    assert outputs(2) == outputs(0)


def test_the_config_refuses_a_negative_count() -> None:
    with pytest.raises(ValueError, match="spare_threads"):
        EngineConfig(spare_threads=-1)


def test_callers_on_two_threads_get_the_same_bits(spare: Callable[..., None]) -> None:
    """The kernels run without the GIL, so two threads may call them at once (two engines in one
    process) and one may resize the pool meanwhile: one caller shares with the helpers, the other
    computes alone or waits, and each gets its own call's bits."""
    layout = kernels.invariant_layouts()[0]
    cases = [invariant_case(m, 2048, 768, layout, seed) for seed, m in enumerate((1, 6, 64))]
    spare(0)
    alone = [run() for run in cases]
    spare(2)
    failures: list[str] = []

    def caller(first: int) -> None:
        for i in range(60):
            case = (first + i) % len(cases)
            if not same_bits(cases[case](), alone[case]):
                failures.append(f"call {i} of case {case}")

    threads = [threading.Thread(target=caller, args=(first,)) for first in (0, 1)]
    for t in threads:
        t.start()
    for helpers in (1, 2, 0, 2):  # resized while the callers run
        spare(helpers)
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert failures == []
