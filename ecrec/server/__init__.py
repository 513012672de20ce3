"""The embedding server process (``ecrec-server serve``): its state, its gRPC service, its registration and
lease; a standby's memory reserve.  Only the command line imports it; strategies see a server through
``ecrec.strategies.base.StrategyHost``."""
