"""The HTTP shell: FastAPI routes, schemas and auth over `jobs`. No business logic lives here."""
