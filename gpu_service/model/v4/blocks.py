"""The fixed query blocks the V4 model works in, torch-free so the memory plan
(gpu_service.plan.bytes_v4) reads the same numbers the model uses."""

ATTN_BLOCK = 256  # queries attended at once: logits [block, heads, keys], a CSA block's picks [block, k, D]
INDEX_BLOCK = 64  # queries the indexer scores at once: [block, index heads, entries] float32 alive
DECODE_INDEX_BLOCK = 8  # batched decode rows the indexer scores at once: [block, padded entries, index heads] f32
