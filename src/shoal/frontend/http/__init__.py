"""The frontend's wire: the HTTP/1.1 server and its client connections (`server`), the
pooled connections to workers (`upstream`), errors in the OpenAI format (`errors`) and CORS
(`cors`). It knows nothing of models, keys or routing; every other frontend package builds on it.
"""
