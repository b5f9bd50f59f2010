"""The render path: a shard's batches through the pipeline, and what each batch leaves in the store.

``runner`` (a shard rendered batch by batch, every batch safe to run twice), ``pipeline`` (the
diffusers call: one key per batch, seeds, PNG metadata), ``batchsize`` (the size per call: probed,
at the knee, halved on out-of-memory), ``stagerun`` and ``stages`` (upscale and refine after
generate), ``outputs`` (pixels to 8 bits on the device), ``commits`` (the commit lane a batch
behind the renderer), ``compiled`` (the shared compile cache), ``loras``, ``prompts`` (long
prompts), ``deviceerrors``, ``benchrender`` (the fixed-time bench model), ``models/`` (loading a
pipeline onto this node's card).

May import: worker.accounting, worker.node.
"""
