"""The fleet as the frontend knows it: the models and instances discovery announces
(`registry`), the watcher and reconciler that keep them in step with the store (`watcher`),
the registrations they change (`registrations`), whether the store answers (`store_state`),
the checksum election (`versions`), the models' metadata files (`metadata`), the routing
policies that pick one instance (`router`) and the frontend's Prometheus metrics (`metrics`,
whose model names are sorted a slice at a time by `names`).
"""
