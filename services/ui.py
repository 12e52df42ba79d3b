"""The web timeline as a service (`tether services ui`, and part of `tether services all`)."""

from tether.ui.server import serve

__all__ = ["serve"]
