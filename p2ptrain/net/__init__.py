"""Async networking: the only place that touches hivemind, sockets or the event loop's I/O."""
