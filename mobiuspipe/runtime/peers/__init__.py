"""The other ranks of the job: who this process is among them, its messages to them, their signs of life."""
