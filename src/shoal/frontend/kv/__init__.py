"""KV-cache-aware routing: the index of which instance holds which KV blocks (`index`), whose
events feed it (`tracker`, per worker over ZMQ, or the relay's stream: `stream`), the prompt's
token ids as the worker computes them (`prompt`) and the `kv` policy that scores instances by
cached prefix and load (`router`).
"""
