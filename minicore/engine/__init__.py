"""The engine core and what drives it: in-process (EngineCore), and later its process and client."""
