"""The engine core and what drives it: in-process (EngineCore), in its own process (EngineCoreProc)
and from the frontend (AsyncEngineClient)."""
