"""Kiln's Python package for clients: dataset checks that run before an upload.

It imports neither torch nor the server, so a client installs it alone.
"""
__version__ = "0.1.0"
