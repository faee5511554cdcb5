"""The scheduling core: pure policy modules (dataclasses in, decisions out, injected clock).

The live services and the simulator call the same code; nothing here does I/O or imports gRPC.
"""
