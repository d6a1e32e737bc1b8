"""Pydantic models whose JSON schemas refer to their own $defs, as clients' tools send them:
one nested (Person holds an Address) and one recursive (a Node holds Nodes)."""
from pydantic import BaseModel


class Address(BaseModel):
    street: str
    city: str


class Person(BaseModel):
    name: str
    address: Address


class Node(BaseModel):
    """Recursive: its schema refers to itself."""
    label: str
    children: list["Node"]
