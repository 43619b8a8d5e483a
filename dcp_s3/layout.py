"""A stored name, not an API: ``.metadata`` pickles name ``dcp_s3.layout.ItemLocation`` (every release so far).

Plain ``pickle`` (torch's own ``FileSystemReader``) imports this path to load them, and new pickles keep naming it
(``ItemLocation.__module__``), so it stays importable whatever moves (``dcp_s3._untrusted.pinned_names``).
"""

from dcp_s3._layout import ItemLocation

__all__ = ["ItemLocation"]
