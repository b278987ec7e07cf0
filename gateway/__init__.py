"""streamgate's HTTP/WebSocket gateway (Starlette). For now: the command-line entry point."""
