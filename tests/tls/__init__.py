"""Test TLS and test executors: a throwaway CA and server certificate made at test time (nothing
private is committed), an HTTPS tool executor and an MCP server (built with the `mcp` package), both
on loopback and both trusted only through the TEST-ONLY RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA."""
