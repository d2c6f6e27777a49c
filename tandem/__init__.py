"""The product's assembly, on top of every other package: the ``tandem`` CLI, ``tandem serve``, the Ray Serve application, the root topology, launching a topology on Ray, the one Ray bootstrap."""
