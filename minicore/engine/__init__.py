"""The engine and what drives it: in-process (EngineCore), in its own process (EngineCoreProc,
started by launch.py), and from the frontend (AsyncLLM over the core client, with the input and
output processors)."""
