"""router: one front door in front of a fleet of inference boxes."""

__version__ = "0.1.0"
