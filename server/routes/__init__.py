"""One module per endpoint; each exposes `router` (routes stay thin: parse, check, call serving)."""
