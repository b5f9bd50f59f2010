"""What runs on the GPU node: model loading, rendering, the shard runner."""
