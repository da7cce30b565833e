//! Integration tests: the real client and CLI against the in-process sandbox.
