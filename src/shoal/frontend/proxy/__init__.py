"""The request path: forwarding an OpenAI request to a worker and its response back
(`proxy`), retries and mid-stream migration to another instance (`migration`) and
disaggregated prefill/decode in two stages (`disagg`).
"""
