"""Tether service entrypoints (parent, child-runner, projector, reconciler), importable as tether_services.*."""
