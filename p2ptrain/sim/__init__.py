"""The WAN simulator: M virtual peers in one process on a virtual clock."""
