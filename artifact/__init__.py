"""The artifact folder format shared by `export` (writes it) and `app` (serves it)."""
