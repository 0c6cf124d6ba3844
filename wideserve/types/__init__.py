"""Plain shared types: requests, sampling parameters, the forward batch, step outputs and messages
(the bottom layer; docs/architecture.md)."""
