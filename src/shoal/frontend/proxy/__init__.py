"""The request path: the entry point that refuses or starts a request (`proxy`), one request
on its way to a worker and back with its retries and timeouts (`forward`), the body fields and
headers that cross (`fields`, `headers`), mid-stream migration to another instance
(`migration`; `sse`, the events it reads; `continuation`, the request that continues a
stream) and disaggregated prefill/decode in two stages (`disagg`).
"""
