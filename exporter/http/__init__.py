"""HTTP: the FastAPI routes (open and admin), the uvicorn server thread, the admin client."""
