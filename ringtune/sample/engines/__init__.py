"""External inference engines behind the Tinker sampling API: the pure translation of requests and answers.

``vllm_api``: :class:`~ringtune.sample.pool.SampleRequest` -> vLLM's OpenAI ``/v1/completions`` body, and its
JSON answer -> :class:`~ringtune.sample.sampler.PromptSamples`. ``forward_routing``: the MoE routing of an engine's
samples, asked of ringtune's forward and put on the sequences. No HTTP and no processes here: the engine's
process is :mod:`ringtune.worker.vllm_engine`, the sampling sessions over it :mod:`ringtune.gateway.vllm_sampling`.
"""
