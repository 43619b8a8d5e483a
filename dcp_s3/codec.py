"""A stored name, not an API: ``.metadata`` pickles of compressed items name ``dcp_s3.codec.FrameIndex``.

Plain ``pickle`` (torch's own ``FileSystemReader``) imports this path to load them, and new pickles keep naming it
(``FrameIndex.__module__``), so it stays importable whatever moves (``dcp_s3._untrusted.pinned_names``).
"""

from dcp_s3._codec.format import FrameIndex

__all__ = ["FrameIndex"]
