"""The rank's SSD store: named records in one folder, their index, the folder's lock and life, I/O futures."""
