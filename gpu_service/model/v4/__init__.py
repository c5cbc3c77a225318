"""DeepSeek-V4 (Flash, Pro) minus the routed experts: mHC hyper-connections, the shared-KV
attention with a sliding window, sinks and compressed entries (CSA with the lightning indexer,
HCA), hash routing and the sqrtsoftplus router. Parameter names are the original checkpoint's."""
