"""Work done on the GPU before records reach the host writer (issue 21): encoders in torch
operations whose output is an existing codec of docs/FORMAT.md, byte for byte."""
