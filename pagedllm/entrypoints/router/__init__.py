"""The model router: many models behind one server, each in its own engine-core process (models.py, entry.py,
manager.py, server.py)."""
