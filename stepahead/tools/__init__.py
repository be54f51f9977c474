"""Tools built on the engine rather than part of it: the scripted worker and `stepahead simulate`."""
