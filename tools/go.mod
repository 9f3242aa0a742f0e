module github.com/better-compute/better-compute/tools

go 1.26
