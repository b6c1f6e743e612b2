"""Who may call and how much: API keys (`keys`), rate and token limits (`limits`), the gate
that applies them to a request (`gate`), metering of what a response used (`metering`) and the
usage book that reports it to the catalog (`usage`).
"""
