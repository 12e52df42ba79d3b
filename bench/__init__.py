"""The Tether benchmark (issue 7): `make bench`, `make bench-peers`; see bench/README.md."""
