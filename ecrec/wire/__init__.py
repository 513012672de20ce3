"""Generated gRPC/protobuf code for the services in ``proto/`` (do not edit; see ``ecrec.protogen``)."""
