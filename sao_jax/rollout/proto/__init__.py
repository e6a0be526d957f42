"""Generated protobuf and gRPC modules for the trajectory stream; see README.md to regenerate."""
