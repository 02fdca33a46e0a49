"""Method modules: one per method (``velox/methods/<key>.py``), each registering its method.

``velox/__init__.py`` imports every one of them by name (a generated, static list).
"""
