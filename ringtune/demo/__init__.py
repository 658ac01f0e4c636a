"""``ringtune demo``: the SDK fine-tunes the embedded SmolLM2-135M through a ``ringtune serve`` child process.

``data`` (the packaged chat dataset and its rendering), ``run`` (the training loop, plot and entry), ``command``
(the CLI flags); the server child is :class:`ringtune.gateway.serve_process.ServeProcess`.
"""
