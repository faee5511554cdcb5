"""A port a service was to listen on that is taken: one error type for the gRPC servers and the
metrics endpoint (kept apart from both, which import each other's neighbours)."""

from __future__ import annotations


class PortInUse(OSError):
    """The port a server was to listen on is taken, most often by another gpuloom. `variable`
    names the setting that chooses the port, when the caller knows it."""

    def __init__(self, host: str, port: int, variable: str = "") -> None:
        self.host, self.port, self.variable = host, port, variable
        message = f"port {port} on {host} is in use (another gpuloom running?)"
        if variable:
            message += f"; set {variable} to another port"
        super().__init__(message)
