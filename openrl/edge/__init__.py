"""The edge: the Tinker wire types, the protobuf codec and API-key auth."""
