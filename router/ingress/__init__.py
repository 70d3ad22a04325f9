"""The front door: the ingress deployment, its gRPC and OpenAI edges, the request flow, admission
and quotas, status codes and ingress telemetry."""
