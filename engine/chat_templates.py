"""Chat templates Tandem supplies where a checkpoint's own cannot render tools
(docs/design.md#tool-calling).

A checkpoint whose template knows ``tools`` (Qwen2.5's, Llama 3.1's...) renders them itself.
SmolLM2's, like many ChatML templates, has no tool support, yet the model was trained to call
functions in one format (the tools listed as JSON in ``<tools>`` in the system prompt, its calls
a JSON list between ``<tool_call>`` tags, results sent back in ``<tool_response>`` tags): the
template below renders a conversation with tools in that format, for the ChatML family.
"""

from __future__ import annotations

# Rendered with the same jinja settings as a checkpoint's template (engine/tokenizer.py):
# ``tools`` are the request's tools (``{"type": "function", "function": {...}}``, as transformers
# passes them; the model sees the function objects: name, description, parameters), an assistant
# message's ``tool_calls`` hold ``arguments`` as parsed JSON, a ``tool`` message's ``content``
# is the function's result.
CHATML_TOOLS = """\
{%- set ns = namespace(rest=messages) -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages and messages[0]['role'] == 'system' -%}
    {{- messages[0]['content'] + '\\n\\n' -}}
    {%- set ns.rest = messages[1:] -%}
{%- endif -%}
{{- 'You can call the functions listed below. Given a question, answer with the calls that \
achieve it, taking each argument from the question; if no function fits, say so instead.\\n' -}}
{{- '<tools>' + (tools | map(attribute='function') | list | tojson) + '</tools>\\n' -}}
{{- 'To call functions, write only a JSON list of calls between tags, each argument of the \
type its parameter asks for:\\n<tool_call>[{"name": "function_name", "arguments": \
{"argument_name": "value"}}]</tool_call><|im_end|>\\n' -}}
{%- for message in ns.rest -%}
    {%- if message['role'] == 'tool' -%}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + \
'\\n</tool_response><|im_end|>\\n' -}}
    {%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}
        {{- '<|im_start|>assistant\\n' + (message.get('content') or '') + '<tool_call>[' -}}
        {%- for call in message['tool_calls'] -%}
            {{- (', ' if not loop.first else '') + '{"name": ' + (call['function']['name'] | tojson) \
+ ', "arguments": ' + (call['function']['arguments'] | tojson) + '}' -}}
        {%- endfor -%}
        {{- ']</tool_call><|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""


def tools_template(own: str | None) -> str | None:
    """The template that renders a conversation with tools for a checkpoint whose template is
    ``own``: its own where it knows ``tools``, Tandem's for its family where there is one, else
    None."""
    if own is not None and "tools" in own:
        return own
    if own is not None and "<|im_start|>" in own:
        return CHATML_TOOLS
    return None
