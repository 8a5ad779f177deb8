"""The op layer: tile plans, transports, the comm engine and the overlapped ops."""
