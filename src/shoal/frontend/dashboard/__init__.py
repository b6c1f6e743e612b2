"""The dashboard: its HTTP endpoints and event stream (`dashboard`), the fleet snapshot and
diffs it sends (`snapshot`) and the browser page (`static/`).
"""
