"""The client: everything here runs in the user's process and talks to workers over a transport."""
