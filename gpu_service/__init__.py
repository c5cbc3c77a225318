"""GPU service: embeddings, MLA attention + compressed KV cache, router, shared experts, lm_head,
sampling, batching, memory plan, experts client and the HTTP / gRPC APIs.

Importing the package is cheap; torch is imported only by the modules that compute."""
