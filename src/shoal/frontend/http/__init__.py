"""The frontend's wire: the HTTP/1.1 server (`listener`: the listening socket and deadlines;
`server`: one client connection; `request`: what a handler sees of them), the pooled
connections to workers (`upstream`, and `target`: the URL an `Upstream` reaches, read once) and small GETs over them (`fetch`: metadata files),
errors in the OpenAI format (`errors`) and CORS (`cors`). It knows nothing of models, keys
or routing; every other frontend package builds on it.
"""
