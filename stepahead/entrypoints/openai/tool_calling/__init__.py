"""Tool calling for /v1/chat/completions: the request's tools checked and turned into a plan (tools.py),
the output read back as calls (calls.py, the incremental JSON scan in call_stream.py), and the parsers
that find calls in free output for tool_choice "auto" (parsers/, one file each)."""
