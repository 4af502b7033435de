// Package xdspb holds our wire-compatible copies of Istio's ambient xDS protos and the type
// URLs ztunnel subscribes to. The generated Go lives in workloadpb (istio.workload) and
// securitypb (istio.security); two Go packages because both proto packages define an Address
// and an Extension message. It owns no logic: conversion to plain Go types is done by package xds.
//
// Regenerate with `make proto` (protoc from Debian's protobuf-compiler, protoc-gen-go v1.36.12);
// `make proto-check` fails when the checked-in code is stale.
package xdspb

// Type URLs of the delta ADS resources ztunnel consumes.
const (
	AddressType       = "type.googleapis.com/istio.workload.Address"
	AuthorizationType = "type.googleapis.com/istio.security.Authorization"
)
